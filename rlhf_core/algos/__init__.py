"""Pure math: losses, KL estimators, advantage estimators (tensor functions, no model, no I/O)."""
