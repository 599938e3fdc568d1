"""Multi-turn, tool-calling rollouts (pure Python; no engines): the agent loop over any turn generator
(:mod:`megarl.agents.loop`), tool-call parsing, tools and their limits, a trajectory's token accounting."""
