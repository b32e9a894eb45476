output "learner_subject" {
  description = "Unique id of the learners' service account: pass it to the AWS root as gcp_learner_subjects."
  value       = google_service_account.learner.unique_id
}

output "instance_group_manager" {
  description = "Managed instance group of the GCP learners (resize to add capacity)."
  value       = module.learners.instance_group_manager
}
