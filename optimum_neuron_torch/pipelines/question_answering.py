"""The `question-answering` pipeline (Transformers 4's, which Transformers 5 removed): the span of
a context that best answers a question, from a model with an extractive question answering head."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Pipeline

from ..errors import ConfigurationError


class QuestionAnsweringPipeline(Pipeline):
    """Answers `question` with a span of `context`: {"score", "start", "end", "answer"}, where
    score is p(start) * p(end) over the context's tokens and the span holds at most
    `max_answer_len` tokens (default 15). A context longer than the model takes is truncated."""

    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False

    def __call__(self, question: str | list[str], context: str | list[str], **kwargs: Any) -> Any:
        """The answer to a question about a context, or a list of answers for lists of both."""
        single = isinstance(question, str)
        if single != isinstance(context, str) or (not single and len(question) != len(context)):
            raise ConfigurationError(
                "question-answering takes a question and a context, or two lists of the same length"
            )
        if single:
            return super().__call__({"question": question, "context": context}, **kwargs)
        pairs = [{"question": q, "context": c} for q, c in zip(question, context, strict=True)]
        return super().__call__(pairs, **kwargs)

    def _sanitize_parameters(self, max_answer_len: int | None = None) -> tuple[dict, dict, dict]:
        return {}, {}, ({} if max_answer_len is None else {"max_answer_len": max_answer_len})

    def preprocess(self, inputs: dict[str, str]) -> dict[str, Any]:
        encoding = self.tokenizer(inputs["question"], inputs["context"], truncation="only_second", return_tensors="pt",
                                  return_offsets_mapping=True)
        in_context = torch.tensor([index == 1 for index in encoding.sequence_ids(0)])
        offsets = encoding.pop("offset_mapping")[0]
        return {
            "model_inputs": dict(encoding), "in_context": in_context, "offsets": offsets, "context": inputs["context"]
        }

    def _forward(self, inputs: dict[str, Any]) -> dict[str, Any]:
        output = self.model(**inputs.pop("model_inputs"))
        return {"start_logits": output.start_logits[0], "end_logits": output.end_logits[0], **inputs}

    def postprocess(self, outputs: dict[str, Any], max_answer_len: int = 15) -> dict[str, Any]:
        in_context = outputs["in_context"]
        start = outputs["start_logits"].float().masked_fill(~in_context, float("-inf")).softmax(-1)
        end = outputs["end_logits"].float().masked_fill(~in_context, float("-inf")).softmax(-1)
        # scores[i, j] = p(start = i) * p(end = j), for spans i <= j of at most max_answer_len tokens
        scores = (start[:, None] * end[None, :]).triu().tril(max_answer_len - 1)
        first, last = divmod(int(scores.argmax()), scores.shape[1])
        begin, finish = int(outputs["offsets"][first][0]), int(outputs["offsets"][last][1])
        answer = outputs["context"][begin:finish]
        return {"score": float(scores[first, last]), "start": begin, "end": finish, "answer": answer}
