"""match, its sub-pixel refinement and filters, soft_match, knn and KNNIndex."""
