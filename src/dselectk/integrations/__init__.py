"""Adapters that put the package's gates into other libraries' models (optional extras).

Each adapter imports its library lazily: importing :mod:`dselectk.integrations` needs nothing
beyond the core. :mod:`dselectk.integrations.hf`: Hugging Face transformers' Mixtral-style MoE
blocks (``pip install dselectk[transformers]``).
"""
