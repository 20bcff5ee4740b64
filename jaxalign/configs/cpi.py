"""CPI-FT on the toy multi-task data (addition, subtraction, reversal, copy): `jaxalign cpi --config cpi`.

The base θ0 is the tiny Llama after a short warm-up on generic arithmetic chat (so it knows the chat format but
none of the four tasks' instructions). Each task gets a short probe fine-tune; cores are the top p = 1 % of the
updates; tasks whose cores overlap (Jaccard >= τ; 0.2 here, where arithmetic and string tasks separate — the
paper's 0.1 puts all four toy tasks in one group) form groups; the fused model is trained group by group on a small
balanced sample of every task (``stage_data="mixed"``, the paper's pipelined stage; ``"group"`` trains each stage on
its group's tasks only) with earlier groups' cores frozen. Baselines: multi-task SFT and sequential SFT with the same
total steps (probes and stages). ``probe_lr`` (0: ``optim.lr``) sets the probes' rate; ``ablations`` adds CPI-FT
without fusion (stages from θ0) and without freezing; ``forgetting="A,B"`` trains task B from task A's probe with and
without A's core frozen and reports A's retention. ``eval_pool`` scores every model on the toy data's "test" pool
(default) or its "validation" pool (to choose learning rates without touching the test questions).
"""

import ml_collections

from jaxalign.configs import base


def get_config(arg=None):
    config = base.get_config()
    config.workdir = "runs/cpi"
    config.tokenizer = "toy"
    config.data.max_length = 48
    config.optim.lr = 3e-3
    config.optim.warmup_steps = 20
    config.train.batch_size = 32
    config.cpi = ml_collections.ConfigDict(dict(
        tasks="add,sub,reverse,copy", train_per_task=1500, eval_per_task=100, base_data="toy:arithmetic",
        base_steps=300, probe_steps=500, fraction=0.01, tau=0.2, include_embeddings=True, include_norms=True,
        omega=0.0, sample_per_task=300, stage_steps=250, stage_data="mixed", probe_lr=0.0, baselines=True,
        ablations=False, forgetting="", max_new_tokens=8, eval_pool="test"))
    return config
