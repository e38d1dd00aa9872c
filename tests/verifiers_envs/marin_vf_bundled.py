"""A verifiers taskset package that ships its own harness (a program marin-rl does not run)."""

import verifiers.v1 as vf

__all__ = ["ProgramHarness", "PromptTaskset"]


class ProgramHarness(vf.Harness[vf.HarnessConfig]):
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        return await runtime.run_program(["my-agent", f"--base-url={endpoint}"], {})


class PromptTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="Hi."), self.config.task)
