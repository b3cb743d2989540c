"""Rollouts: G samples per prompt from the servers, dynamic sampling, partial rollouts, multi-turn
episodes token-in/token-out, the step's generation and its metrics, rollouts that overlap training,
and the distillation teacher's scores of the student's samples."""
