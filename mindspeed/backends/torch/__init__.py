"""torch backend. Submodules import torch; capabilities.py does not."""
