"""Drafting without a separate draft model: Medusa heads, EAGLE, lookahead and prompt lookup, verified as trees.

>>> from labkit import drafting
>>> tree = drafting.tree_from_choices([(0,), (1,), (0, 0)])      # parents (-1, 0, 0, 1)
>>> drafting.tree_mask(tree.parents)                               # ancestor-or-self, [4, 4]
>>> heads = drafting.MedusaHeads(hidden_size, num_heads=4)
>>> spec.train_model(heads, text, plan, seed=0, loss_fn=drafting.medusa_loss(target))
>>> out = drafting.generate_tree(drafting.TreeRunner(target, 512, (tree.size,)),
...                              drafting.MedusaProposer(heads, target.lm_head.weight, tree), prompt, 128)

One capability, one package: these all *propose* candidates for the verification of
:mod:`labkit.spec` (whose runner, cache, training loop and output type they reuse), but
they need what a draft model never did: trees of candidates and their attention mask,
the target's hidden states, heads trained on them, and n-gram machinery.

- :mod:`~labkit.drafting.tree`: tree masks, depths, Medusa's ``choices``, the best tree
  for measured head accuracies, and the greedy acceptance walk;
- :mod:`~labkit.drafting.runner`: :class:`TreeRunner`, the target's tree step (graphed);
- :mod:`~labkit.drafting.heads`: Medusa heads and the EAGLE head, and their losses;
- :mod:`~labkit.drafting.ngram`: prompt lookup, Jacobi decoding, lookahead's n-gram pool;
- :mod:`~labkit.drafting.loop`: :func:`generate_tree` and the four proposers.
"""

from .heads import EagleHead, MedusaHeads, eagle_loss, head_accuracy, medusa_loss
from .loop import (EagleProposer, Graphed, LookaheadProposer, MedusaProposer, PromptLookupProposer, Proposer, Step,
                   generate_tree)
from .ngram import NGramPool, jacobi_decode, prompt_lookup
from .runner import TreeRunner
from .tree import (Tree, best_choices, chain, check_parents, greedy_accept, parents_from_mask, tree_depths,
                   tree_from_choices, tree_mask)

__all__ = [
    "EagleHead", "EagleProposer", "Graphed", "LookaheadProposer", "MedusaHeads", "MedusaProposer", "NGramPool",
    "PromptLookupProposer", "Proposer", "Step", "Tree", "TreeRunner", "best_choices", "chain", "check_parents",
    "eagle_loss", "generate_tree", "greedy_accept", "head_accuracy", "jacobi_decode", "medusa_loss",
    "parents_from_mask", "prompt_lookup", "tree_depths", "tree_from_choices", "tree_mask",
]
