"""The reference trainer on torch.distributed: model-parallel embeddings, data-parallel dense parts.

The standard DLRM/TorchRec scheme. Each rank holds a slice of the global batch (the single-process
batch, split in contiguous slices). Embedding tables are sharded table-wise (table t on rank
t % world size): ids go to the table owners by all-to-all, the owners pool over the global batch and
send the pooled vectors back by all-to-all; backward sends the pooled gradients to the owners, who
apply row-wise Adagrad to their rows once per step. The encoder and the HASTE output layer are
replicated and trained under DDP, their gradients all-reduced.

  plan.py               who owns which tables and samples; unimplemented schemes are ConfigErrors
  process_group.py      the job's process group (targets.ranks) plus the embedding exchanges' own
  exchange.py           the all-to-alls (input dist, pooled output dist) and an all-gather for evaluation
  sharded_embeddings.py the owned tables (an EmbeddingStore) behind the two exchanges
  dense.py              encoder + output layer, built as the single-process model, under DDP
  session.py            one rank's step, probe, grad norms and quality
  train.py              the torchrun entry point; rank 0 writes the JSON result

The sg-opt workers run it through haste-rec's ``build_ranked`` (targets/haste_rec/target.py) when a
request asks for ``ranks`` > 1: ``targets.rank_worker`` for bench, numerics and quality runs,
``validators.ab_worker`` for side-by-side timing.
"""
