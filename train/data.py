"""Datasets on disk (jsonl), loading through `datasets`, chat tokenization, padding and batching.

* `write_dataset(folder, n_train, n_eval, seed)` writes ``train.jsonl`` / ``eval.jsonl`` of generated
  examples (`train.tasks`); eval questions never repeat a train question.
* `prepare_dataset(folder, ...)` is what the CLIs call: generate when missing, reuse a dataset only
  when the parameters the user set match the ones recorded in its ``meta.json``, else refuse
  (`DatasetMismatchError` naming every difference; nothing is overwritten).
* `load_split(folder, split)` loads them with ``datasets.load_dataset("json", data_files=...)``
  (local files only; no progress bars unless stderr is a terminal; a temporary cache folder when
  the `datasets` cache cannot be written).
* `tokenize_row` renders the prompt with the tokenizer's chat template (system + user message,
  generation prompt added) and appends the response tokens + the end-of-turn token, so training
  sees exactly the ids inference produces: the prompt ids, then generated ids. For an activated
  (aLoRA) adapter the invocation token ids end the prompt (`append_invocation`: added when the
  prompt does not contain them already).
* `pad_batch` right-pads to a length bucket and builds the per-token response mask.
* `BatchIterator`: seeded epoch shuffles with a resumable integer position (batches consumed).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from typing import Iterable, Sequence

import numpy as np

from train.tasks import SYSTEM_PROMPT, TASKS, generate_examples

SPLITS = ("train", "eval")
META = "meta.json"
log = logging.getLogger("train.data")


class DatasetMismatchError(ValueError):
    """An existing dataset folder holds other data than the run asks for (the message names it)."""


FIELD_TYPES = {"answer": None}     # a row's field -> its JSON types (default: a string; None: any but null -
                                   # a custom reward function takes lists, objects, booleans)


class DatasetFormatError(ValueError):
    """A dataset file that is not jsonl rows of the fields a trainer reads (the message names the file,
    the line and what is wrong)."""


# ------------------------------------------------------------------------------------ on disk
def split_path(folder: str | os.PathLike, split: str) -> pathlib.Path:
    """Where a dataset folder holds one split's rows: ``<folder>/<split>.jsonl``."""
    return pathlib.Path(folder) / f"{split}.jsonl"


def write_dataset(folder: str | os.PathLike, n_train: int, n_eval: int, seed: int = 0,
                  tasks: Sequence[str] = TASKS, max_ops: int = 3) -> dict[str, str]:
    """Writes train.jsonl and eval.jsonl; returns {split: path}. Deterministic per (sizes, seed, tasks)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train = generate_examples(n_train, seed, tasks, max_ops)
    seen = {e.question for e in train}
    evals, k = [], 0
    while len(evals) < n_eval:      # eval stream from a different seed, deduplicated against train
        for e in generate_examples(max(2 * n_eval, 8), seed + 1_000_003 + k, tasks, max_ops):
            if e.question not in seen and len(evals) < n_eval:
                seen.add(e.question)
                evals.append(dataclasses.replace(e, id=f"eval-{len(evals)}-{e.task}"))
        k += 1
        if k > 100:
            raise ValueError(f"could not draw {n_eval} eval examples distinct from the train set")
    paths = {}
    for split, rows in (("train", train), ("eval", evals)):
        path = split_path(folder, split)
        with open(path, "w", encoding="utf-8") as f:
            for e in rows:
                f.write(json.dumps(e.to_json()) + "\n")
        paths[split] = str(path)
    with open(folder / META, "w", encoding="utf-8") as f:
        json.dump(generation_params(n_train, n_eval, seed, tasks, max_ops), f, indent=1)
    return paths


def generation_params(n_train: int, n_eval: int, seed: int = 0, tasks: Sequence[str] = TASKS,
                      max_ops: int = 3) -> dict:
    """What `write_dataset` records in meta.json (and what `prepare_dataset` compares)."""
    return {"n_train": n_train, "n_eval": n_eval, "seed": seed, "tasks": list(tasks), "max_ops": max_ops}


def prepare_dataset(folder: str | os.PathLike, params: dict, given: dict[str, str]) -> str:
    """Makes sure `folder` holds the dataset a training run asks for; returns one line saying what it did.

    params: `generation_params(...)` of the run. given: {param: the flag that set it, e.g. "--n-train 40"}
    for the parameters the user set explicitly (the others are defaults).
    * no train.jsonl: the dataset is generated (`write_dataset`).
    * one generated earlier (meta.json): reused when every parameter in `given` equals the recorded
      one; otherwise DatasetMismatchError naming each difference. It is never regenerated in place:
      the folder may be another run's or the user's data, and a resumed run must see the rows it
      was trained on.
    * jsonl files without meta.json (a dataset of the user's): used as is; DatasetMismatchError when
      generation flags were given, since they cannot apply.
    """
    folder = pathlib.Path(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        train, evals = split_path("", "train").name, split_path("", "eval").name
        hint = (f" (a dataset folder holds {train} and {evals}: pass --data {folder.parent})"
                if folder.name in (train, evals) else "")
        raise DatasetMismatchError(f"--data {folder}: not a folder{hint}")
    if not split_path(folder, "train").is_file():
        write_dataset(folder, **params)
        return f"generated the dataset in {folder} ({_describe(params)})"
    try:
        recorded = json.loads((folder / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        if given:
            raise DatasetMismatchError(
                f"--data {folder} holds a dataset without {META} (not generated by train.data), so "
                f"{', '.join(given.values())} cannot apply: drop those flags to train on it as it is, or pick "
                f"another --data") from None
        return f"using the dataset in {folder} as it is (no {META}: not generated here)"
    except (OSError, ValueError) as e:
        raise DatasetMismatchError(f"--data {folder}: unreadable {META} ({e})") from None
    if not isinstance(recorded, dict):
        raise DatasetMismatchError(f"--data {folder}: {META} is not a JSON object")
    diff = [f"{k}={recorded.get(k)!r} (this run: {params[k]!r}, from {flag})"
            for k, flag in given.items() if recorded.get(k) != params[k]]
    if diff:
        raise DatasetMismatchError(
            f"--data {folder} holds a dataset generated with other parameters: {'; '.join(diff)}. "
            f"Pick another --data (or --out), delete {folder} to regenerate it, or drop those flags to reuse it")
    return f"reusing the dataset in {folder} ({_describe(recorded)})"


def _describe(p: dict) -> str:
    return (f"n_train={p.get('n_train')}, n_eval={p.get('n_eval')}, seed={p.get('seed')}, "
            f"tasks={','.join(p.get('tasks') or [])}, max_ops={p.get('max_ops')}")


def check_jsonl(path: pathlib.Path, fields: Sequence[str] = ()) -> int:
    """The number of rows of a jsonl file whose every non-blank line is a JSON object holding `fields`;
    `DatasetFormatError` naming the file, the line and the fault otherwise (`datasets` answers those
    with a traceback of its own)."""
    rows = 0
    try:
        with open(path, encoding="utf-8-sig") as f:        # a BOM, as `datasets` allows
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    hint = ("; a .jsonl file holds one JSON object per line, not a JSON array"
                            if rows == 0 and line.lstrip().startswith("[") else "")
                    raise DatasetFormatError(f"{path}, line {i}: not valid JSON ({e.msg}, column {e.colno}){hint}") \
                        from None
                if not isinstance(row, dict):
                    hint = "; a .jsonl file holds one JSON object per line" if isinstance(row, list) else ""
                    raise DatasetFormatError(f"{path}, line {i}: a row must be a JSON object, got "
                                             f"{type(row).__name__}{hint}")
                missing = [k for k in fields if k not in row]
                if missing:
                    raise DatasetFormatError(f"{path}, line {i}: no {', '.join(map(repr, missing))} field (each row "
                                             f"needs {', '.join(map(repr, fields))})")
                for k in fields:
                    types = FIELD_TYPES.get(k, (str,))
                    if row[k] is None if types is None else not isinstance(row[k], types):
                        what = "set (not null)" if types is None else "a string"
                        raise DatasetFormatError(f"{path}, line {i}: field {k!r} must be {what}, got "
                                                 f"{json.dumps(row[k])[:40]}")
                rows += 1
    except UnicodeDecodeError as e:
        raise DatasetFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return rows


def load_split(folder: str | os.PathLike, split: str = "train", cache_dir: str | None = None,
               fields: Sequence[str] = ()):
    """A `datasets.Dataset` of one split, loaded from the local jsonl with the json builder, after
    `check_jsonl` (every row a JSON object holding `fields`, the ones its caller reads). An empty
    eval split is an empty list (no evaluation: `--n-eval 0`); an empty train split is an error."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = split_path(folder, split)
    if not path.is_file():
        raise FileNotFoundError(f"no {path}; create the dataset with train.data.write_dataset")
    if not check_jsonl(path, fields):
        if split == "eval":
            return []
        raise DatasetFormatError(f"{path} has no rows")
    import datasets

    from preft_jax.progress import enabled
    if not enabled():
        datasets.disable_progress_bars()            # its "Generating train split" bars
    if cache_dir is None:
        cache_dir = _datasets_cache_fallback()
    return datasets.load_dataset("json", data_files={split: str(path)}, split=split, cache_dir=cache_dir)


_TEMP_CACHE: list[str] = []


def _datasets_cache_fallback() -> str | None:
    """None (datasets' own cache) when it can be written, else a temporary folder for this process
    (a missing or read-only home), announced once."""
    import datasets
    from preft_jax.cache.location import writable_reason
    if _TEMP_CACHE:
        return _TEMP_CACHE[0]
    why = writable_reason(datasets.config.HF_DATASETS_CACHE)
    if not why:
        return None
    import atexit
    import shutil
    import tempfile
    tmp = tempfile.mkdtemp(prefix="preft_datasets_")
    atexit.register(shutil.rmtree, tmp, True)
    _TEMP_CACHE.append(tmp)
    log.warning("datasets cache %s cannot be written (%s): using a temporary folder for this process (set "
                "HF_DATASETS_CACHE to a writable folder)", datasets.config.HF_DATASETS_CACHE, why)
    return tmp


# ------------------------------------------------------------------------------- tokenization
def prompt_messages(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict]:
    msgs = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return msgs + [{"role": "user", "content": question}]


def encode_prompt(tokenizer, question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[int]:
    """Prompt ids exactly as served: chat template with the assistant generation prompt."""
    return tokenizer.encode_chat(prompt_messages(question, system_prompt), add_generation_prompt=True)


def end_of_turn_id(tokenizer) -> int:
    if not tokenizer.eos_token_ids:
        raise ValueError("tokenizer has no end-of-turn / eos token")
    return tokenizer.eos_token_ids[0]


@dataclasses.dataclass
class Tokenized:
    """Token lists of a dataset split: sequence b is prompts[b] + responses[b]."""
    prompts: list[list[int]]
    responses: list[list[int]]
    answers: list[int]

    def __len__(self):
        return len(self.prompts)

    def sequence(self, i: int) -> list[int]:
        return self.prompts[i] + self.responses[i]


def append_invocation(prompt: Sequence[int], invocation: Sequence[int] | None) -> list[int]:
    """`prompt` + the invocation ids, unless the prompt contains them already (an activated adapter
    then acts from their last occurrence); unchanged without an invocation."""
    from preft_jax.adapters.policy import last_occurrence
    if not invocation or last_occurrence(prompt, invocation) is not None:
        return list(prompt)
    return list(prompt) + list(invocation)


def tokenize_row(tokenizer, row: dict, system_prompt: str | None = SYSTEM_PROMPT,
                 invocation: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids (+ the invocation ids, see `append_invocation`), response ids + end-of-turn id).
    Special-token text in the question or the response is encoded as ordinary text: only the chat
    template and the appended end of turn are control tokens (`Tokenizer.encode_text`)."""
    prompt = append_invocation(encode_prompt(tokenizer, row["question"], system_prompt), invocation)
    encode_text = getattr(tokenizer, "encode_text", tokenizer.encode)
    response = encode_text(row["response"]) + [end_of_turn_id(tokenizer)]
    return prompt, response


class LazyTokenized:
    """A `Tokenized`-like view of rows that tokenizes a row the first time it is read.

    In a multi-process run each process reads only its rows of every batch, so it tokenizes only
    those. `rows` is any random-access sequence of dicts (a `datasets.Dataset`, a list)."""

    def __init__(self, tokenizer, rows, system_prompt: str | None = SYSTEM_PROMPT,
                 invocation: Sequence[int] | None = None):
        self._tok, self._rows, self._system, self._invocation = tokenizer, rows, system_prompt, invocation
        self._cache: dict[int, tuple[list[int], list[int]]] = {}
        self.prompts, self.responses = _Column(self, 0), _Column(self, 1)

    def __len__(self):
        return len(self._rows)

    def pair(self, i: int) -> tuple[list[int], list[int]]:
        i = int(i)
        if i not in self._cache:
            self._cache[i] = tokenize_row(self._tok, self._rows[i], self._system, self._invocation)
        return self._cache[i]

    def sequence(self, i: int) -> list[int]:
        p, r = self.pair(i)
        return p + r


class _Column:
    def __init__(self, owner: LazyTokenized, part: int):
        self.owner, self.part = owner, part

    def __len__(self):
        return len(self.owner)

    def __getitem__(self, i):
        return self.owner.pair(i)[self.part]


def tokenize_dataset(tokenizer, rows: Iterable[dict], system_prompt: str | None = SYSTEM_PROMPT,
                     max_len: int | None = None, invocation: Sequence[int] | None = None) -> Tokenized:
    """Tokenizes every row; rows longer than max_len tokens are dropped."""
    out = Tokenized([], [], [])
    for row in rows:
        p, r = tokenize_row(tokenizer, row, system_prompt, invocation)
        if max_len is not None and len(p) + len(r) > max_len:
            continue
        out.prompts.append(p)
        out.responses.append(r)
        out.answers.append(int(row["answer"]))
    return out


# ------------------------------------------------------------------------------------ batches
@dataclasses.dataclass
class Batch:
    """Right-padded teacher-forcing batch.

    tokens [B, T] int32; prompt_lengths [B]; lengths [B] (prompt + response);
    loss_mask [B, T] float32 - 1 on response tokens (t in [prompt_length, length)), the tokens
    whose log-likelihood is scored (predicted by the logits at t - 1). Prompt and padding are 0.
    """
    tokens: np.ndarray
    prompt_lengths: np.ndarray
    lengths: np.ndarray
    loss_mask: np.ndarray

    def arrays(self) -> dict:
        return dataclasses.asdict(self)


def bucket(n: int, multiple: int = 16, max_len: int | None = None) -> int:
    """Smallest multiple of `multiple` >= n (capped at max_len, which must still fit n)."""
    t = max(multiple, -(-n // multiple) * multiple)
    if max_len is not None:
        if n > max_len:
            raise ValueError(f"sequence of {n} tokens exceeds max_len={max_len}")
        t = min(t, max_len)
    return t


def pad_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int = 0,
              length: int | None = None, multiple: int = 16) -> Batch:
    """Concatenates prompt + response per row and right-pads to `length` (default: bucket of the max)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError("need equally many (>= 1) prompts and responses")
    lengths = np.array([len(p) + len(r) for p, r in zip(prompts, responses)], np.int32)
    plens = np.array([len(p) for p in prompts], np.int32)
    if np.any(plens < 1):
        raise ValueError("every prompt needs at least one token")
    T = bucket(int(lengths.max()), multiple) if length is None else length
    if lengths.max() > T:
        raise ValueError(f"sequence of {lengths.max()} tokens does not fit length {T}")
    tokens = np.full((len(prompts), T), pad_id, np.int32)
    mask = np.zeros((len(prompts), T), np.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tokens[b, :len(p)] = p
        tokens[b, len(p):len(p) + len(r)] = r
        mask[b, len(p):len(p) + len(r)] = 1.0
    return Batch(tokens, plens, lengths, mask)


class BatchIterator:
    """Deterministic, resumable batches over a Tokenized split.

    Epoch e visits the rows in the order `permutation(seed, e)`; the position is the number of
    batches consumed so far (an int that checkpoints store). Batches never straddle epochs (the
    last partial batch of an epoch is dropped).
    """

    def __init__(self, data: Tokenized, batch_size: int, seed: int = 0, position: int = 0,
                 pad_id: int = 0, length: int | None = None, multiple: int = 16, shuffle: bool = True):
        if batch_size < 1 or batch_size > len(data):
            raise ValueError(f"batch_size {batch_size} must be in [1, {len(data)}] (the dataset size)")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.position, self.pad_id, self.length, self.multiple = position, pad_id, length, multiple
        self.shuffle = shuffle
        self.per_epoch = len(data) // batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.data))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.data))

    def indices(self, position: int) -> np.ndarray:
        epoch, k = divmod(position, self.per_epoch)
        return self._order(epoch)[k * self.batch_size:(k + 1) * self.batch_size]

    def batch_at(self, position: int) -> Batch:
        idx = self.indices(position)
        return pad_batch([self.data.prompts[i] for i in idx], [self.data.responses[i] for i in idx],
                         self.pad_id, self.length, self.multiple)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        b = self.batch_at(self.position)
        self.position += 1
        return b


def eval_batches(data: Tokenized, batch_size: int, pad_id: int = 0, length: int | None = None,
                 multiple: int = 16) -> list[Batch]:
    """Every row once, in order; the last batch is padded with copies of row 0 masked out."""
    out = []
    for s in range(0, len(data), batch_size):
        idx = list(range(s, min(s + batch_size, len(data))))
        n_real = len(idx)
        idx += [0] * (batch_size - n_real)
        b = pad_batch([data.prompts[i] for i in idx], [data.responses[i] for i in idx], pad_id, length, multiple)
        b.loss_mask[n_real:] = 0.0
        out.append(b)
    return out
