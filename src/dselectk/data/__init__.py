"""Loaders for the datasets used in the DSelect-k paper."""
