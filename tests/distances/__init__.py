"""pairwise_distance, nearest_prototype and PrototypeDistance."""
