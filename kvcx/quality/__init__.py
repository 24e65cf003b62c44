"""The quality wing: does a compressed cache still serve the model? (torch and transformers, imported lazily)

- :mod:`kvcx.quality.models`: where the model and the evaluation text come from, and loading them;
- :mod:`kvcx.quality.model_cache`: a GGUF model's conversion kept on disk after its first load;
- :mod:`kvcx.quality.bridge`: transformers caches <-> kvcx tensors, saving and loading caches;
- :mod:`kvcx.quality.validation`: ``kvcx validate``: perplexity, KL divergence and top-1 agreement;
- :mod:`kvcx.quality.calibrate`: ``kvcx calibrate``: per-layer plans and the queries' key weights;
- :mod:`kvcx.quality.plots`: the SNR heatmap and the Pareto chart (matplotlib, an extra).
"""
