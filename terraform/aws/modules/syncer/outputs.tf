output "instance_id" {
  description = "ID of the syncer VM (connect with SSM Session Manager; no SSH is opened)."
  value       = aws_instance.syncer.id
}

output "private_ip" {
  description = "Private IP of the syncer VM."
  value       = aws_instance.syncer.private_ip
}

output "user_data" {
  description = "The rendered cloud-init user data (for review; contains no credentials)."
  value       = local.user_data
}
