"""Input formats: how a model's call maps to named tensor leaves, in both layouts (tensors by
name, dict keys and dataclass fields in ``leaves.py``; column ranges of a packed input in
``columns.py``; TorchRec ``KeyedJaggedTensor`` keys in ``kjt*.py``)."""
