"""Training objectives, one room each, behind the `Objective` interface (base.py) that the generic Trainer
calls: `pretrain` and `sft` (lm.py: next-token cross entropy on a token stream / on packed conversations
with a loss mask), `dpo` (dpo.py, with its losses in preference.py and reference log-probs in refs.py).
A new objective subclasses `Objective` and registers its name with `register`; a config selects it with
`objective: NAME` (and `imports: [module]` for one outside this package).

May import: storage, train.model, train.monitor, train.checkpoint, train.generation, train.eval, and
train.state / train.config (docs/architecture.md). Nothing below imports this package except
train.config, which reads the registry and the objectives' config sections.
"""
from train.objectives.base import Objective, get, import_plugins, names, register

__all__ = ["Objective", "get", "import_plugins", "names", "register"]
