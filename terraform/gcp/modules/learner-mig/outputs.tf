output "instance_group_manager" {
  description = "Name of the regional managed instance group (resize it to add or remove learners)."
  value       = google_compute_region_instance_group_manager.learners.name
}

output "instance_template" {
  description = "Self link of the learners' instance template."
  value       = google_compute_instance_template.learner.self_link
}

output "user_data" {
  description = "The rendered cloud-init user data (for review; contains no credentials)."
  value       = local.user_data
}
