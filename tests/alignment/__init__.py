"""align and certify_alignment."""
