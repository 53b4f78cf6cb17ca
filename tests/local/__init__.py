"""local_match and local_cost_volume."""
