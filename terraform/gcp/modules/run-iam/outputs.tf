output "learner_service_accounts" {
  description = "Fleet id -> email of that fleet's learner service account."
  value       = { for fleet in var.learner_fleets : fleet => google_service_account.role["learner-${fleet}"].email }
}

output "syncer_service_account" {
  description = "Email of the syncer service account."
  value       = google_service_account.role["syncer"].email
}

output "conditions" {
  description = "Role key -> the CEL conditions (read, write) that the bucket IAM bindings carry."
  value       = local.conditions
}
