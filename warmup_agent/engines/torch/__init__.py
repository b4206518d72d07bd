"""The torch engine: the model in this process.  engine.py loads and runs it;
model_classes.py picks transformers' modelling classes; native_config.py (no
torch), native_lm.py and native_tokenizer.py are the plain-torch forward;
serving.py and batcher.py serve users from the same process.  Empty on purpose:
importing this package imports no torch."""
