"""Building blocks of the Qwen3.5 text model (norms, attention, Gated DeltaNet, MLP, MTP head)."""
