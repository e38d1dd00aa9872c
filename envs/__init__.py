"""Environments: problems, prompts, verifiers, multi-turn tools; see docs/envs.md.

Write an env by subclassing `Env`; run it with `sample_group` (training) or `evaluate` (pass@k).
Built-in env types: `exact_match`, `math`, `reasoning_gym`, `calculator`, `verifiers`.
"""

from marin_rl.envs._calculator import CalculatorEnv, calculate
from marin_rl.envs._chat import ChatTemplateError, Message, Transcript, render
from marin_rl.envs._env import Env, build_env, env_types, register_env, resolve_env_class, reward
from marin_rl.envs._exact_math import ExactMatchEnv, MathEnv, exact_match, math_equal, normalize_answer
from marin_rl.envs._parsers import (
    PARSERS,
    ParseResult,
    Parser,
    compose,
    first_of,
    get_parser,
    identity,
    last_boxed,
    last_number,
    xml_tag,
)
from marin_rl.envs._problems import Problem, ProblemStream, load_problems, problems_from
from marin_rl.envs._reasoning_gym import ReasoningGymEnv
from marin_rl.envs._toy import ToyAdditionEnv, ToyNextLetterEnv
from marin_rl.envs._rewards import EnvMetrics, Scores, VerifierThreads
from marin_rl.envs._verifiers import VerifiersEnv
from marin_rl.envs._runner import EvalResult, RolloutSettings, evaluate, gather_all, pass_at_k, resolve_settings, sample_group
from marin_rl.envs._sampling import (
    Completion,
    OpenAISampler,
    Sampler,
    SamplerError,
    SamplingParams,
    ScriptedSampler,
    async_openai_client,
    token_prompt_arguments,
)

__all__ = [
    "PARSERS",
    "CalculatorEnv",
    "ChatTemplateError",
    "Completion",
    "Env",
    "EnvMetrics",
    "EvalResult",
    "ExactMatchEnv",
    "MathEnv",
    "Message",
    "OpenAISampler",
    "ParseResult",
    "Parser",
    "Problem",
    "ProblemStream",
    "ReasoningGymEnv",
    "RolloutSettings",
    "Sampler",
    "SamplerError",
    "SamplingParams",
    "Scores",
    "ScriptedSampler",
    "async_openai_client",
    "token_prompt_arguments",
    "ToyAdditionEnv",
    "ToyNextLetterEnv",
    "VerifierThreads",
    "Transcript",
    "VerifiersEnv",
    "build_env",
    "calculate",
    "compose",
    "env_types",
    "evaluate",
    "gather_all",
    "exact_match",
    "first_of",
    "get_parser",
    "identity",
    "last_boxed",
    "last_number",
    "load_problems",
    "math_equal",
    "normalize_answer",
    "pass_at_k",
    "problems_from",
    "register_env",
    "render",
    "resolve_env_class",
    "resolve_settings",
    "reward",
    "sample_group",
    "xml_tag",
]
