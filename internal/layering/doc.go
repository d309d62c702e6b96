// Package layering holds no code: its test checks the module's package
// dependency graph against the project's one-way layering rules and
// against the golden copy in testdata/deps.golden.
//
// Regenerate the golden file after an intended change of imports with
//
//	go test ./internal/layering -update
//
// The rules themselves are asserted separately, so regenerating the golden
// file cannot accept an import that breaks them.
package layering
