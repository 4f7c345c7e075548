"""A calculator agent written with the ``openai`` client only: no DSPy, no flowopt (a test checks).

Task: ``"add 3 4"`` or ``"mul 2 5"``; the answer is the number. The agent asks the LLM which tool to use;
if the LLM's reply names ``calculator`` the agent computes the answer with its own tool, else it asks the LLM for
the answer directly. Its reward, which it reports to the server itself, is 1 for the right answer.
"""

from __future__ import annotations

import httpx
from openai import OpenAI

OPERATIONS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}


def calculator(question: str) -> str:
    """The agent's tool: ``"add 3 4"`` -> ``"7"``."""
    op, a, b = question.split()
    return str(OPERATIONS[op](int(a), int(b)))


def run_episode(base_url: str, model: str, headers: dict[str, str], temperature: float, reward_url: str,
                question: str, expected: str) -> str:
    client = OpenAI(base_url=base_url, api_key="unused", default_headers=headers, max_retries=0, timeout=120)

    def ask(prompt: str, max_tokens: int) -> str:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=temperature)
        return (reply.choices[0].message.content or "").strip()

    uses_tool = "calculator" in ask(f"question : {question} tool :", 4).split()
    answer = calculator(question) if uses_tool else ask(f"question : {question} answer :", 1)
    httpx.post(reward_url, json={"reward": float(answer == expected)}, headers=headers, timeout=120).raise_for_status()
    return answer
