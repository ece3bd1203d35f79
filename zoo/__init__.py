"""zoo: efficient LM architectures, recall synthetics and their training.

Importing zoo registers model_type "zoo" (`zoo.models.hf.ZooConfig`, `ZooForCausalLM`) with transformers'
AutoConfig and AutoModelForCausalLM; this imports transformers.
"""

from zoo.models.hf import register as _register_with_transformers

_register_with_transformers()
