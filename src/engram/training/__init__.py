"""Training: the corpus (corpus), batches with hash ids computed in the pipeline (batches), the
train loop (train), RowAdam and AdamW (optim), a run's table export (run_tables), and multi-process
training with sharded tables (process_group, distributed, dist_checkpoint)."""
