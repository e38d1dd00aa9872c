"""A verifiers tool taskset: a local Python tool server (verifiers starts it as a process) adds numbers."""

import verifiers.v1 as vf

__all__ = ["CalcTaskset"]


class Calc(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace) -> float:
        return float(any(m.name == "calc_add" for m in trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a, b in ((2, 3), (40, 2)):
            yield CalcTask(CalcData(prompt=f"What is {a}+{b}?", system_prompt="Use the tools.", answer=str(a + b)), self.config.task)


if __name__ == "__main__":
    Calc.run()
