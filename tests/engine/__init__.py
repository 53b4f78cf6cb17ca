"""The tiled top-k engine: exactness against float64, the certified half-precision search, memory caps."""
