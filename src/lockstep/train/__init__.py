"""lockstep.train: deterministic training on a lockstep model, with the same ops as the engine.

    losses      what a step minimises: cross entropy, the RL policy loss (a per-token form)
    optim       AdamW, the global gradient norm, clipping, the learning-rate schedule
    data        training text, the packed token stream, windows and micro-batches
    sync        GradientSync: the gradient exchange (one process here; lockstep.dist for DP and TP)
    sharded     AdamW with its state sharded over the data-parallel ranks by a fixed partition
    trainer     TrainConfig and the Trainer, whose `step` is the one optimizer step of every caller
    checkpoint  a run's state on disk, written atomically, resumed at any layout
    run         `lockstep train`: run folder, log and checkpoints
"""

from .checkpoint import RESUMABLE, latest_checkpoint, model_fingerprint
from .data import PackedDataset, micro_batches, read_texts, sequences_of
from .losses import CrossEntropy, PolicyLoss, RouterAuxLoss, TokenLoss, cross_entropy_sum
from .optim import AdamW, AdamWConfig, clip_scale, grad_norm, lr_at, square_sum
from .run import make_model_and_tokens, prepare_out, read_log, run, truncate_log
from .sharded import ShardedAdamW, partition
from .sync import GradientSync, SingleProcessSync
from .trainer import NonFiniteLoss, TrainConfig, Trainer

__all__ = ["AdamW", "AdamWConfig", "CrossEntropy", "GradientSync", "NonFiniteLoss", "PackedDataset", "PolicyLoss",
           "RESUMABLE", "RouterAuxLoss", "ShardedAdamW", "SingleProcessSync", "TokenLoss", "TrainConfig", "Trainer",
           "clip_scale", "cross_entropy_sum", "grad_norm", "latest_checkpoint", "lr_at", "make_model_and_tokens",
           "micro_batches", "model_fingerprint", "partition", "prepare_out", "read_log", "read_texts", "run",
           "sequences_of", "square_sum", "truncate_log"]
