"""The reference trainer on torch.distributed: model-parallel embeddings, data-parallel dense parts.

The standard DLRM/TorchRec scheme. Each rank holds a slice of the global batch (the single-process
batch, split in contiguous slices). Embedding tables are sharded table-wise (table t on rank
t % world size: ids go to the table owners by all-to-all, the owners pool over the global batch and
send the pooled vectors back by all-to-all) or row-wise (every table's rows in contiguous blocks over
all ranks: each bag is split by block owner and sent by all-to-all, every owner pools partial sums
over the global batch, and the sums over owners are reduce-scattered back by samples); backward sends
the pooled gradients to the owners, who apply row-wise Adagrad to their rows once per step. The
encoder and the HASTE head are replicated and trained under DDP, their gradients all-reduced. The
HASTE tail is either replicated with them (tail_sharding replicated) or sharded by label groups
(label-groups): each rank owns whole groups, computes them over the global batch from all-gathered
hidden states and trains them alone, the hidden states' gradients going back by reduce-scatter.

  plan.py               who owns which tables or row blocks, tail groups and samples; unimplemented schemes
                        are ConfigErrors
  process_group.py      the job's process group (targets.ranks) plus the embedding exchanges' own
  exchange.py           the input and output dists of both schemes (all-to-alls) and an all-gather for evaluation
  sharded_embeddings.py the owned tables or row blocks (an EmbeddingStore) behind the two exchanges
  dense.py              encoder + output layer, built as the single-process model, under DDP (the owned
                        tail groups left out of it under label-groups)
  sharded_tail.py       the label-group tail's exchanges: hidden states, positives, logits for evaluation
  session.py            one rank's step, probe, grad norms and quality
  train.py              the torchrun entry point; rank 0 writes the JSON result

The sg-opt workers run it through haste-rec's ``build_ranked`` (targets/haste_rec/target.py) when a
request asks for ``ranks`` > 1: ``targets.rank_worker`` for bench, numerics and quality runs,
``validators.ab_worker`` for side-by-side timing.
"""
