"""zoo: efficient LM architectures, recall synthetics and their training.

Importing zoo is light (no torch): the commands' --help and --version answer at once. The transformers
classes (model_type "zoo") register with AutoConfig and AutoModelForCausalLM when `zoo.models.hf` is
imported; a saved Zoo checkpoint also loads without it, through `trust_remote_code=True` (zoo/models/hf.py).
"""

__version__ = "0.2.0"
