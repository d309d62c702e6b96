module github.com/rollout-worker/rollout-worker

go 1.26

require (
	github.com/nlpodyssey/safetensors v0.0.0-20250209183917-bfb01cc25f7c
	go.uber.org/zap v1.28.0
)

require go.uber.org/multierr v1.10.0 // indirect
