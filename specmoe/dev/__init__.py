"""Developer tools that check the project itself rather than run models: `python -m specmoe.dev.mutate` plants a
fixed list of bugs one at a time and reports which ones the tests catch (docs/mutation.md)."""
