"""Decoding: the runtime every strategy runs on (`runtime`), the strategies (`strategies`: plain and the one
speculative step), where drafts come from (`drafters`), draft trees and their selection (`trees`), and `auto`'s
cost model and controller (`control`)."""
