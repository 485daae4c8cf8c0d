"""A user reward function named in a test's RL config (`rl.rewards: [{name: rl_rewards:length_reward}]`)."""


def length_reward(prompts, completions, answers):
    """A reward a random model earns with variance: shorter completions score more, and digits help."""
    return [1.0 / (1 + len(c)) + sum(ch.isdigit() for ch in c) for c in completions]
