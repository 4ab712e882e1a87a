"""What the harness's rank processes import before their first world, imported once by
the fork server whose forks they are (harness._context): torch, Megatron (wandb hidden,
as the trainer imports it), transformers and vLLM's LLM, then what each vLLM-CPU engine's
start does first (compat.vllm.prepare_engine_start). Started new, a rank paid these
imports itself: ~8 CPU s, ~13 with vLLM, for every world in new processes (a world after
one that ran vLLM, fresh=True, a retired worker's replacement)."""
import os
import warnings

# torch reads it when it loads (harness._entry sets it again per rank, too late for that).
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TransformerEngine|apex).*")

from megatron_grpo.platform.compat.megatron import import_core  # noqa: E402

import_core()
import transformers  # noqa: E402,F401
from vllm import LLM  # noqa: E402,F401

from megatron_grpo.platform.compat import vllm as compat_vllm  # noqa: E402

compat_vllm.prepare_engine_start()     # once for every engine its forks start

import gc  # noqa: E402

# The ranks are forks of this process: its modules' objects (hundreds of thousands) live as
# long as every rank, and the cyclic collector's passes over them free nothing; frozen, a
# rank's collections skip them (and do not copy their pages by touching them).
gc.collect()
gc.freeze()
