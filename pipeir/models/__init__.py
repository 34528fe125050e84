"""Built-in model specs (a small MLP, a small transformer LM) for demos and tests."""
