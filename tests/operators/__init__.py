"""densematch's operations as PyTorch operators: opcheck, torch.compile, export, fake tensors, torch.func."""
