"""
The second tier: what a real run needs around the reference (dflash2.py). It plugs into dflash2.py through
plain inputs, and what it swaps in computes dflash2.py's formulas (fast_loss: the same values, another of equally
large candidates where they tie): delete it and dflash2.py still holds the whole algorithm. Imports run
train.py -> harness -> dflash2.py; nothing here imports train.py. One module per job:

    target      the frozen target: loading, dtype, its family -> the drafter's shape, RoPE and view of the
                tables, the view check, the mask token, the features the loss reads (cached)
    data        chat data -> training rows (the loss mask), batches, the data order and anchor seeds
    checkpoint  a run's drafter (new, or warm-started from an export), the export engines serve (§7), the
                resume state and the record of a training run
    fast_loss   the §6 loss as train.py runs it: dflash2.slot_sums with a cheaper top-K of the same values
    metrics     the §6 metrics of a batch, the evaluation on the validation rows, the end-of-run decoding
    memory      the memory plan of a training step on one GPU, the CPU allocator's huge pages
    regenerate  on-policy data: the target answers the conversations itself
    lookup      drafts looked up in the request's own tokens, and the gate between them and the drafter
    tiny_world  the offline world of `python train.py`: a tiny target and its data, built once and cached

Entry points: python -m harness.checkpoint (an export and its serving commands), python -m harness.regenerate
(on-policy data), python -m harness.memory (the memory plan). Nothing is imported here: import the module.
"""
