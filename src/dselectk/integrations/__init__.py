"""Adapters that put the package's gates into other libraries' models (optional extras).

Each adapter imports its library lazily: importing :mod:`dselectk.integrations` needs nothing
beyond the core. :mod:`dselectk.integrations.hf`: Hugging Face transformers' MoE models
(Mixtral, Qwen-MoE, OLMoE and the other families listed there), saved and loaded through the
model's config (``pip install dselectk[transformers]``).
"""
