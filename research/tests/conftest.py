"""Shared settings of the research part's tests."""

from __future__ import annotations

import os

import torch
from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=60, derandomize=True)
settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(min(2, torch.get_num_threads()))
