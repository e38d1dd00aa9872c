"""A multi-turn verifiers environment: the env answers each guess with `higher` or `lower`."""

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessTaskset"]


class GuessData(vf.TaskData):
    answer: int = 0


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def solved(self, trace) -> float:
        return float(trace.last_reply == str(self.data.answer))

    @vf.reward(weight=-0.1)
    async def guesses(self, trace) -> float:
        return float(trace.num_turns)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for n in (3, 7):
            yield GuessTask(GuessData(prompt="Guess my number (1-9).", system_prompt="Digits only.", answer=n), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 4


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()  # the prompted task speaks first
            for _ in range(self.config.max_guesses - 1):
                if segment.terminated or segment.last_reply == str(task.data.answer):
                    return
                guess = int(segment.last_reply) if segment.last_reply.isdigit() else 0
                segment = await chat.turn("higher" if guess < task.data.answer else "lower")
