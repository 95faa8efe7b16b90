"""`hetero-jax bench` and what it is made of: the closed loop (`loop`), the workloads
(`workloads`), the table and plot (`report`), the transformers baseline (`hf_baseline`)."""
