"""``PromptSet``: a task's prompts rendered with the chat template, tokenised once, length-filtered.

Prompts over ``max_prompt_len`` are dropped before any generation: counted (``num_filtered``) and
named (``filtered_sources``, the first ones in ``summary()``). Invariant:
group g maps to ``kept[perm(seed, epoch)[g % N]]``, ``epoch = g // N``, ``perm =
default_rng([seed, epoch]).permutation(N)``: the same in every worker (docs/design.md#determinism-the-contract).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from areal_async.data.prompt_cache import cached_token_ids
from areal_async.data.task import Task


class PromptItem(msgspec.Struct, frozen=True):
    """One prompt, ready to send.

    Fields:
        data_index: index of the item in the task (before filtering).
        prompt_ids: ``[P]`` token ids, chat template applied, ``P <= max_prompt_len``.
        gold: the gold answer for the reward function.
        row: the item's row as read (``TaskItem.row``; ``{}`` for a task without ``item``), for
            reward functions that take ``item``.
    """

    data_index: int
    prompt_ids: list[int]
    gold: str
    row: dict[str, Any] = {}


class PromptSet:
    """A task's prompts for one tokenizer.

    Args:
        task: the prompt source.
        tokenizer: an HF tokenizer with a chat template.
        max_prompt_len: longest prompt kept, in tokens (``>= 1``).
        seed: run seed of the group → prompt permutation (``>= 0``).
        cache_dir: where tokenised prompt sets are cached (``prompt_cache.cache_dir_of``);
            ``None``: not cached. ``cache_status`` says how the ids were had (``off``, ``hit``, ``miss``, ``stale``).

    Raises:
        ValueError: ``max_prompt_len < 1``, a negative seed, or no prompt fits (names the
            longest/shortest lengths and the setting to change).
    """

    def __init__(self, task: Task, tokenizer, max_prompt_len: int, seed: int, cache_dir=None):
        if max_prompt_len < 1 or seed < 0:
            raise ValueError(f"PromptSet needs max_prompt_len >= 1 and seed >= 0, got "
                             f"{max_prompt_len}, {seed}")
        self.task = task
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.seed = seed
        ids, self.cache_status = cached_token_ids(task, tokenizer, cache_dir)
        lengths = [len(x) for x in ids]
        self._kept = [i for i, n in enumerate(lengths) if n <= max_prompt_len]
        self._item = getattr(task, "item", None)  # test doubles implement only messages and gold
        self.filtered_sources = [self._source(i) for i, n in enumerate(lengths) if n > max_prompt_len]
        self._ids = [np.asarray(ids[i], dtype=np.int32) for i in self._kept]
        self.num_total = len(lengths)
        self.num_filtered = self.num_total - len(self._kept)
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        if not self._kept:
            shortest = min(range(len(lengths)), key=lengths.__getitem__, default=None)
            named = f", the shortest {self._source(shortest)}" if shortest is not None else ""
            fix = "shorten the prompts" if task.name == "file" else "lower data.few_shot"  # file: no demonstrations
            raise ValueError(
                f"no prompt of task '{task.name}' fits data.max_prompt_len={max_prompt_len} "
                f"tokens (prompt lengths {min(lengths, default=0)}..{max(lengths, default=0)}{named}); "
                f"raise data.max_prompt_len (and inference.max_seq_len) or {fix}"
            )

    def __len__(self) -> int:
        """N: number of prompts kept."""
        return len(self._kept)

    def at(self, j: int) -> PromptItem:
        """The ``j``-th kept prompt in dataset order (``0 <= j < N``); used for evaluation."""
        i = self._kept[j]
        return PromptItem(data_index=i, prompt_ids=self._ids[j].tolist(), gold=self.task.gold(i),
                          row=self._item(i).row if self._item else {})

    def _source(self, i: int) -> str:
        return (self._item(i).source if self._item else "") or f"item {i}"

    def for_group(self, group_id: int) -> PromptItem:
        """The prompt of group ``g``: ``kept[perm(seed, g // N)[g % N]]``.

        Raises:
            ValueError: ``group_id < 0``.
        """
        if group_id < 0:
            raise ValueError(f"group ids are >= 0, got {group_id}")
        epoch, r = divmod(group_id, len(self))
        return self.at(int(self._permutation(epoch)[r]))

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:  # groups arrive roughly in id order: one epoch cached
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self))
            self._perm_epoch = epoch
        return self._perm

    def decode(self, output_ids: list[int]) -> str:
        """Response text of generated ids (special tokens such as eos dropped)."""
        return self.tokenizer.decode(output_ids, skip_special_tokens=True)

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end a response: the tokenizer's eos."""
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def summary(self) -> str:
        """One line for the logs: prompts kept and filtered, the first filtered ones named."""
        line = (f"task {self.task.name}: {len(self)} of {self.num_total} prompts kept, "
                f"{self.num_filtered} longer than max_prompt_len={self.max_prompt_len} filtered")
        if self.filtered_sources:
            shown = self.filtered_sources[:3] + (["..."] if self.num_filtered > 3 else [])
            line += f" ({', '.join(shown)}; raise data.max_prompt_len to keep them)"
        return line
