"""The smallest MQAR run the CPU tests train: a 16-wide model over a 64-token vocabulary, 64 training examples of
16 tokens with 2 key-value pairs, in batches of 32 (2 steps an epoch), 32 for validation and 32 for test. Each test
adds the model, epochs and stopping rule it needs."""

SEGMENT = "{seq_len:16,num_kv_pairs:2,num_examples:%d,batch_size:32}"
TINY_MODEL = ["model.d_model=16", "data.vocab_size=64"]
TINY_DATA = [f"data.train=[{SEGMENT % 64}]", f"data.valid=[{SEGMENT % 32}]", f"data.test=[{SEGMENT % 32}]"]
TINY_RUN = TINY_MODEL + TINY_DATA
