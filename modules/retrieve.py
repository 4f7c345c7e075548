"""``Retrieve``: BM25 (via ``bm25s``) over the example's own context paragraphs or a fixed corpus."""

from __future__ import annotations

import threading
from typing import Any

import dspy

from flowopt.errors import ConfigError
from flowopt.operator import Operator
from flowopt.registry import register_operator
from flowopt.settings import between, check_settings
from flowopt.signature import SignatureSpec


@register_operator
class Retrieve(Operator):
    """Return the ``k`` passages that best match the query field.

    With ``corpus=None`` the node takes a ``list[str]`` context input (e.g. HotpotQA's paragraphs) and
    ranks it per example; with a ``corpus`` the index is built once and the node takes only the query.
    No LM is called.

    Example:
        >>> from flowopt.modules import Retrieve
        >>> r = Retrieve(k=1)
        >>> paragraphs = ["Berlin is in Germany.", "Paris is the capital of France."]
        >>> r(question="capital of France?", context=paragraphs).passages
        ['Paris is the capital of France.']
    """

    op_name = "Retrieve"

    def __init__(self, signature: str | SignatureSpec | None = None, instructions: str | None = None, *,
                 k: int = 3, corpus: list[str] | None = None) -> None:
        """``instructions``: the task description given to the LM (default: the signature's own).
        ``k``: passages returned; ``corpus``: the passages to search (``None``: the
        example's ``context`` paragraphs)."""
        if signature is None:
            signature = ("question -> passages: list[str]" if corpus is not None
                         else "question, context: list[str] -> passages: list[str]")
        super().__init__(signature, instructions)
        check_settings("Retrieve", {"k": k, "corpus": corpus}, hints=Retrieve.__init__,
                       bounds={"k": between(1, 1000)})
        spec = self._spec
        want_inputs = 1 if corpus is not None else 2
        if (len(spec.inputs) != want_inputs or len(spec.outputs) != 1 or spec.outputs[0].type != "list[str]"
                or (corpus is None and spec.inputs[1].type != "list[str]")):
            raise ConfigError(
                f"Retrieve signature {spec.input_names} -> {spec.output_names} does not fit "
                f"{'a corpus' if corpus is not None else 'per-example context'}",
                fix="use 'query -> passages: list[str]' with corpus=..., else "
                    "'query, context: list[str] -> passages: list[str]'")
        if corpus is not None and not corpus:
            raise ConfigError("Retrieve corpus must be a non-empty list of strings", fix="pass corpus=[...]")
        self.k, self.corpus = k, corpus
        self._index: Any = None
        self._index_lock = threading.Lock()

    def config(self) -> dict[str, Any]:
        return {"k": self.k} if self.corpus is None else {"k": self.k, "corpus": list(self.corpus)}

    def forward(self, **inputs: Any) -> dspy.Prediction:
        query = str(inputs[self._spec.inputs[0].name])
        if self.corpus is None:
            passages = [str(p) for p in inputs[self._spec.inputs[1].name]]
            ranked = _rank(_build_index(passages), passages, query, self.k)
        else:
            with self._index_lock:
                if self._index is None:
                    self._index = _build_index(self.corpus)
            ranked = _rank(self._index, self.corpus, query, self.k)
        return dspy.Prediction(**{self._spec.outputs[0].name: ranked})

    def __deepcopy__(self, memo: dict[int, Any]) -> Retrieve:
        # The index is derived data; rebuild it lazily in the copy rather than copy it.
        new = Retrieve(self._spec, k=self.k, corpus=self.corpus)
        memo[id(self)] = new
        return new


def _build_index(passages: list[str]) -> Any:
    import bm25s

    retriever = bm25s.BM25()
    if passages:
        retriever.index(bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False)
    return retriever


def _rank(retriever: Any, passages: list[str], query: str, k: int) -> list[str]:
    import bm25s

    if not passages:
        return []
    tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
    if not tokens.vocab:  # the query is only stopwords: keep the original order
        return passages[:k]
    k = min(k, len(passages))
    docs, _scores = retriever.retrieve(tokens, k=k, show_progress=False)
    return [passages[int(i)] for i in docs[0]]
