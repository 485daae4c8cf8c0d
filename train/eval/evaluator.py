"""The evaluation run used in the training loop and by `train eval`: validation loss on the held-out split
and log-likelihood multiple-choice tasks, through one `Scorer` on the model in memory, and generative tasks
(train.eval.generative) on a transformers mirror of it.

Everything that does not depend on the weights (task items, their token ids, tree rows, validation
sequences, generative prompts) is built once; each call of `run()` only scores and generates. Metrics come
back flat (`val/<source>/{loss,ppl,bpb}`, `eval/<task>/{acc,acc_norm,acc_token}`,
`eval/gsm8k_cot/exact_match/strict-match`, ...), ready for the metric sinks.
"""
from __future__ import annotations

import time

from storage.config import ConfigError
from storage.evaltasks import Task
from train.eval.requests import encode_items, task_metrics
from train.eval.scorer import Row, Scorer, flat_rows, supports_trees, tree_row
from train.eval.validation import ValidationSet


def check_tokenizer(tokenizer_path: str, model_vocab: int) -> int:
    """The tokenizer's vocabulary size; refused when it does not fit the model's embedding."""
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(tokenizer_path).get_vocab_size(with_added_tokens=True)
    if n > model_vocab:
        raise ConfigError(f"tokenizer {tokenizer_path} has {n} tokens but the model's vocabulary has {model_vocab}: "
                          "they do not belong together")
    return n


class Generative:
    """Generative tasks on the model in memory: every rank hands its weights to a transformers mirror on
    rank 0 (train.generation.sync), which generates with the engine and scores; the metrics go to every
    rank, the per-item details stay on rank 0."""

    def __init__(self, cfg, specs: list[str], tokenizer_path: str, par):
        from train.generation.sync import HFMirror

        self.cfg, self.par = cfg, par
        self.mirror = HFMirror(cfg.model)
        self.tasks, self.engine = [], None
        if par.rank == 0:
            from train.eval.generative import GenerativeTask
            from train.generation.load import tokenizer_for

            self.tok, template, self.eos = tokenizer_for(tokenizer_path)
            g, m = cfg.eval.generation, cfg.model.resolved()
            limit = g.limit if g.limit is not None else cfg.eval.limit
            self.tasks = [GenerativeTask(s, limit, self.tok, max_length=m.max_position_embeddings,
                                         chat_template=template, chat=g.chat_template, max_new_tokens=g.max_new_tokens,
                                         stop=g.stop, samples=g.samples, temperature=g.temperature,
                                         timeout_s=g.timeout_s, unsafe_exec=g.unsafe_exec,
                                         first=cfg.eval.limit_mode == "first") for s in specs]

    def run(self, chunks: list) -> tuple[dict[str, float], dict]:
        import torch.distributed as dist

        model = self.mirror.sync(chunks)
        metrics, details = {}, {}
        if self.par.rank == 0:
            from train.generation.engine import Engine

            g = self.cfg.eval.generation
            if self.engine is None:
                self.engine = Engine(model, self.tok, self.eos, backend=g.backend, max_batch_size=g.batch_size,
                                    prompt_lookup=g.prompt_lookup)
            for t in self.tasks:
                m, d = t.run(self.engine)
                metrics.update(m)
                details[t.name] = {"generative": True, **d}
        box = [metrics]
        dist.broadcast_object_list(box, src=0)
        return box[0], details


class Evaluator:
    def __init__(self, scorer: Scorer, *, tasks: list[Task], tokenizer_path: str | None, eos_id: int | None,
                 max_length: int, validation: ValidationSet | None, shared_context: bool = True,
                 generative: Generative | None = None):
        self.scorer, self.tasks, self.validation, self.generative = scorer, tasks, validation, generative
        self.trees = shared_context and supports_trees(scorer.model)
        self.rows: list[Row] = []
        self.where: dict[str, list[list[tuple[int, int]]]] = {}  # task → item → candidate → (row, span)
        self.n_tokens: dict[str, list[list[int]]] = {}
        if tasks:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(tokenizer_path)
            for t in tasks:
                self._add_task(t, encode_items(tok, t.items, max_length, eos_id))

    def _add_task(self, task: Task, encoded) -> None:
        where, ntok = [], []
        for cands in encoded:
            inputs = [(c.context + c.continuation)[:-1] for c in cands]
            labels = [(c.context + c.continuation)[1:] for c in cands]
            scored = [len(c.continuation) for c in cands]
            ntok.append(scored)
            if self.trees:
                where.append([(len(self.rows), j) for j in range(len(cands))])
                self.rows.append(tree_row(inputs, labels, scored))
            else:
                where.append([(len(self.rows) + j, 0) for j in range(len(cands))])
                self.rows += flat_rows(inputs, labels, scored)
        self.where[task.name], self.n_tokens[task.name] = where, ntok

    def run(self) -> tuple[dict[str, float], dict]:
        """(flat metrics, per-task details with every candidate's log-likelihood)."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.validation is not None:
            metrics.update(self.validation.evaluate(self.scorer))
        details: dict = {}
        if self.rows:
            scores = self.scorer.score(self.rows)
            for t in self.tasks:
                ll = [[scores[r][s] for r, s in item] for item in self.where[t.name]]
                m = task_metrics(t.items, ll, self.n_tokens[t.name], t.kind)
                details[t.name] = {"metrics": m, "item_ids": [it.item_id for it in t.items], "logliks": ll}
                metrics.update({f"eval/{t.name}/{k}": v for k, v in m.items()
                                if k in ("acc", "acc_norm", "acc_token", "bpb")})
        if self.generative is not None:
            gm, gd = self.generative.run(self.scorer.model)
            metrics.update(gm)
            details.update(gd)
        metrics["eval_time_s"] = time.perf_counter() - t0
        return metrics, details


def build_evaluator(cfg, model_chunks, par, tokenizer_path: str | None, dataset: str | None,
                    warn=print) -> Evaluator:
    """The evaluator of a TrainConfig (`cfg.eval`); a dataset without a held-out split gives a warning
    (through `warn`) and no validation loss, not an error."""
    from storage.fs import read_bytes
    from train.checkpoint.hf_tokenizer import resolve_eos
    from train.eval.validation import NoValidationSet

    ec = cfg.eval
    m = cfg.model.resolved()
    eos = None
    if ec.tasks and tokenizer_path is None:
        raise ConfigError("key 'eval.tasks': benchmarks need a tokenizer (the dataset's, or the checkpoint's)")
    if ec.tasks:
        check_tokenizer(tokenizer_path, m.vocab_size)
        found = resolve_eos(read_bytes(tokenizer_path), tokenizer_path,  # the dataset's EOS, as the export's
                            _hf_eos_token(tokenizer_path))
        if found is None:
            raise ConfigError(f"tokenizer {tokenizer_path}: its EOS is unknown (no dataset manifest beside it, "
                              "not exactly one special token); the EOS prefixes empty contexts")
        eos = found[1]
    validation = None
    if ec.validation_tokens and dataset:
        try:
            validation = ValidationSet.from_dataset(dataset, cfg.data.seq_len, ec.validation_tokens)
        except NoValidationSet as e:
            warn(str(e))
    scorer = Scorer(model_chunks, par, batch_tokens=ec.batch_tokens)
    specs = ec.generative_tasks()
    return Evaluator(scorer, tasks=ec.load_tasks(), tokenizer_path=tokenizer_path, eos_id=eos,
                     max_length=ec.max_length or m.max_position_embeddings, validation=validation,
                     shared_context=ec.shared_context,
                     generative=Generative(cfg, specs, tokenizer_path, par) if specs else None)


def _hf_eos_token(tokenizer_path: str) -> str | None:
    """The EOS of a HF tokenizer folder's tokenizer_config.json (an imported checkpoint's carried files)."""
    import json
    import os

    cfg = os.path.join(os.path.dirname(tokenizer_path), "tokenizer_config.json")
    if "://" in tokenizer_path or not os.path.isfile(cfg):
        return None
    with open(cfg) as f:
        eos = json.load(f).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos
