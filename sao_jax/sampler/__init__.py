"""sampler package."""
