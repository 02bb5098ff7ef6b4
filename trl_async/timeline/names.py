"""The span names and categories every process records, in one place: the trainer, the generation process and the
analysis read the same constants (a renamed span cannot silently drop out of the analysis).

Categories (the trace's `cat`): `busy` work, `wait` a named idle cause (the process blocks on another), `startup` the
generation process's start-up, `step` the recorded-steps track (which steps this process kept; see `SamplingPolicy`).
"""

from __future__ import annotations

BUSY = "busy"
WAIT = "wait"
STARTUP = "startup"
STEP = "step"

# Trainer rank.
WAIT_FOR_BATCH = "wait for batch"  # wait: the queue has no batch fresh enough yet
MAKE_BATCH = "make batch"  # the trainer generates a batch itself while its generation process starts
SCORE = "score"  # TRL's scoring of a batch (`_generate_and_score_completions`: log-probs, advantages)
FORWARD_BACKWARD = "forward + backward"
OPTIMIZER_STEP = "optimizer step"
PUBLISH_WEIGHTS = "publish weights"
PUBLISH_START_WEIGHTS = "publish start-up weights"  # the frozen weights into their store, on a thread at the start
WAIT_FOR_LOADS = "wait for loads"  # wait: fixed staleness holds the next publish until the generator loaded
LOG = "log"
SAVE_CHECKPOINT = "save checkpoint"

# Generation process (and the trainer's own batches while it starts).
GATE_WAIT = "gate wait"  # wait: the staleness gate (no room in the queue, or no recent enough weights)
TOKENIZE = "tokenize"  # the batch's prompts drawn, tokenized, rewards prepared
PREFILL = "prefill"
DECODE = "decode"
REWARDS = "rewards"
TOOLS = "tools"  # tool calls and environment calls (factory, reset) of agentic runs (`rollout.agentic`)
WRITE_BATCH = "write batch"  # pickling the payload into the queue's spool
LOAD_WEIGHTS = "load weights"
WAIT_FOR_START_WEIGHTS = "wait for start-up weights"  # wait: the trainer still publishes the frozen weights
COMPILE_DECODE = "compile decode"  # capturing the CUDA graphs of the decode, before the generation process is ready
STARTUP_SPAN = "start-up"  # spawn -> ready, category `startup`

# Synchronous runs (`async_generation=False`): generation and training in turn, in the trainer.
GENERATE = "generate"
TRAIN = "train"

# Start-up instants of a generation process, in the order they happen.
SPAWN = "spawn"
IMPORTS_DONE = "imports done"
MODEL_BUILT = "model built"
READY = "ready"
FIRST_BATCH_QUEUED = "first batch queued"
STARTUP_MARKS = (SPAWN, IMPORTS_DONE, MODEL_BUILT, READY, FIRST_BATCH_QUEUED)

# What moves to the generation process in an asynchronous run, and what stays in the trainer: the two sides of the
# limit computed from a synchronous run (`analysis.sync_limit`). Nested spans are counted once (interval unions), and
# training time excludes any generation span inside it (TRL's scoring call contains the sampling in a synchronous run).
GENERATION_NAMES = (GENERATE, MAKE_BATCH, TOKENIZE, PREFILL, DECODE, REWARDS, TOOLS)
TRAINING_NAMES = (TRAIN, SCORE, FORWARD_BACKWARD, OPTIMIZER_STEP)

# Roles, in the order their rows appear in a trace.
TRAINER = "trainer"
GENERATOR = "generator"
ROLES = (TRAINER, GENERATOR)
