"""Draft trees (a chain is a tree of width 1): the tree, its verification batch and the acceptance rules (`tree`),
and cost-aware selection of the subtree to verify (`selection`'s pure functions, `treeselect`'s online selector)."""
