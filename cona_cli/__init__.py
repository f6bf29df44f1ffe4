"""cona: chain parallelism strategies while an LLM trains. The controller side: the `cona` command
line, the planner, the controller and its policies, cluster launchers and reports."""
