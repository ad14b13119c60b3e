"""Step 3 of ``prepare`` (``prepare.py``): each rank reads its units of work
(``sources.py``) batch by batch (``document_reader.py``) and keeps only their tokens, on disk
(``spill.py``).

A text file is tokenized whole; each document of a records file is encoded on its own
after the document separator, so a unit's tokens do not depend on where units begin and
the file is the same for any number of ranks. A character vocabulary is every rank's
characters (the units are read twice). Memory per rank is one batch being read and its
tokens: ``docs/design/data-path.md`` ("Parallel preparation").
"""

from __future__ import annotations

from pathlib import Path


from hpctrain.data.format import token_dtype
from hpctrain.data.prepare_group import attempt
from hpctrain.data.document_reader import BadRecords, read_unit
from hpctrain.data.sources import TEXT, Plan
from hpctrain.data.spill import TokenSpill
from hpctrain.data.tokenizers import (CharTokenizer, document_separator, encode_documents,
                                      make_tokenizer)
from hpctrain.progress import Progress


def tokenize(group, plan: Plan, tokenizer: str, text_field: str, show: bool,
             spill_beside: Path) -> tuple:
    """The tokenizer, the token dtype (little-endian), this rank's tokens unit by unit
    (a sealed ``TokenSpill`` beside ``spill_beside``: the caller removes it), and every
    rank's bad records (the same on every rank)."""
    tok = None if tokenizer == "char" else attempt(group, lambda: make_tokenizer(tokenizer),
                                                    "tokenizer")
    if tok is None:
        chars = attempt(group, lambda: _characters(plan, text_field), "reading the inputs")
        union = set().union(*group.allgather("".join(sorted(chars)), "vocabulary"))
        tok = attempt(group, lambda: CharTokenizer("".join(sorted(union))), "vocabulary")
    dtype = token_dtype(tok.vocab_size).newbyteorder("<")
    progress = Progress(len(plan.mine), "tokenize" + (f" (rank 0 of {group.size})"
                                                      if group.size > 1 else ""), enabled=show)
    bad = BadRecords()
    made = []  # the spill, once made: removed on a failure on any rank
    try:
        attempt(group, lambda: made.append(TokenSpill(spill_beside, dtype)),
                "temporary file")
        spill = made[0]
        attempt(group, lambda: _encode_units(tok, dtype, plan, plan.mine, text_field,
                                             tokenizer == "byte", bad, progress, spill),
                "reading the inputs")
        attempt(group, spill.seal, "reading the inputs")
        progress.close()
        every = group.allgather([bad.count, bad.first], "bad records")
    except BaseException:
        for spill in made:
            spill.remove()
        raise
    return tok, dtype, spill, BadRecords.merged(every)


def _batches(plan: Plan, unit: list[int], text_field: str, bad: BadRecords,
             raw_text: bool = False):
    """The batches of documents of one unit; a text file's one document ends in a newline
    unless it is the last file."""
    f, start, stop, _ = unit
    for batch in read_unit(plan.names[f], plan.formats[f], start, stop, text_field, bad,
                           raw_text):
        if plan.formats[f] == TEXT:
            end = b"\n" if raw_text else "\n"
            if batch[0] and not batch[0].endswith(end) and f != len(plan.names) - 1:
                batch = [batch[0] + end]
        yield batch


def _characters(plan: Plan, text_field: str) -> set:
    chars = {"\n"} if plan.has_records else set()
    for unit in plan.mine:
        for batch in _batches(plan, unit, text_field, BadRecords()):
            for doc in batch:
                chars.update(doc)
    return chars


def _encode_units(tok, dtype, plan: Plan, units: list[list[int]], text_field: str,
                  raw_text: bool, bad: BadRecords, progress: Progress,
                  spill: TokenSpill) -> None:
    separator = document_separator(tok) if plan.has_records else []
    for unit in units:
        for batch in _batches(plan, unit, text_field, bad, raw_text):
            spill.append(tok.encode(batch[0]) if plan.formats[unit[0]] == TEXT
                         else encode_documents(tok, batch, separator))
        spill.end_unit()
        progress.update(1, plan.names[unit[0]].rsplit("/", 1)[-1][:30])
