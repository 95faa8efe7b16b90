"""`hetero-jax bench` and what it is made of: its flags and `BenchConfig` (`config`), the
closed loop (`loop`), the workloads (`workloads`), the table's columns and the plot (`report`),
the transformers baseline (`hf_baseline`)."""
