"""The stages a user runs (`rlhf prep`, `rlhf eval`, `rlhf pairs`) and the launch of a training stage."""
